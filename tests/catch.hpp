// Includes Catch2 2.x or 3.x, whichever the system has, with the 2.x spellings the tests use
// (Approx, Catch::Contains) available in both.
#pragma once
#ifdef MOE_CATCH_V3
#include <catch2/catch_all.hpp>
#include <string>
using Catch::Approx;
namespace Catch {
inline Matchers::StringContainsMatcher Contains(const std::string& s) {
  return Matchers::ContainsSubstring(s);
}
}  // namespace Catch
#else
#include <catch2/catch.hpp>
#endif
