// Includes Catch2 2.x or 3.x, whichever the system has.
#pragma once
#ifdef MOE_CATCH_V3
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif
