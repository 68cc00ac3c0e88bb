// Data-parallel ranks must run the same job, and nothing else makes sure they do: each rank
// reads its own config, flags, data files and run directory. A rank built with another model
// shape calls the collectives with other sizes (MPI then reports a truncated message, or writes
// past the smaller rank's buffers and the process crashes); another ZeRO stage calls other
// collectives (a hang until the watchdog); another seed, other data or another checkpoint to
// resume trains silently wrong, or runs other steps and crashes later. So at start-up, before
// the first collective that depends on any of it, the ranks compare what they run with: one
// small all_gather when they agree, and otherwise every rank stops with the same ConfigError
// naming the first key that differs and its value on rank 0 and on the first rank that differs.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moe/comm.hpp"
#include "moe/config.hpp"
#include "train/train_data.hpp"

namespace moe {

// (key, value) pairs in a fixed order; a value is one line.
using RankFacts = std::vector<std::pair<std::string, std::string>>;

// What must agree: every leaf of the resolved config at its key path, except train.device,
// compared as the device type (several GPU ranks may each name their own GPU; pick_local_gpu
// decides), and train.gpu_memory_limit_gib (a cap of this rank's memory, no part of the math);
// train.resume as the checkpoint this rank resumes from (resume_dir, "" for none: a rank that
// sees another run directory resumes elsewhere); "train.out_dir (as each rank sees it)":
// `run_dir_seen`, what RunDirProbe found (run_dir_probe.hpp); and, last, "data": the source's
// description and a hash of its first micro-batch (drawn and put back: `data` is where it was),
// which tells files of other sizes or contents at the same path apart (a difference later in the
// stream is not seen: the shards carry no checksum).
RankFacts run_facts(const Config& cfg, Device dev, const std::string& resume_dir,
                    const std::string& run_dir_seen, TrainData& data);

// Every rank calls it with its facts (a collective). Returns when all agree; otherwise throws,
// on every rank, one ConfigError naming the first key (in rank 0's order) whose value differs
// between rank 0 and the lowest rank that differs from it, with both values.
void check_same_on_all_ranks(Comm& comm, const RankFacts& facts);

}  // namespace moe
