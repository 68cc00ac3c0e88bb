# Multi-rank tests (included by tests/CMakeLists.txt when MOE_MPI is on). The executable has its
# own main and runs only under mpirun, through run_mpi.sh; it is not a test_*.cpp of tests/, so
# the one-executable-per-file loop there does not pick it up. Labels "cpu;mpi": `ctest -L mpi`.
add_executable(test_comm_mpi ${CMAKE_CURRENT_LIST_DIR}/test_comm_mpi.cpp)
target_link_libraries(test_comm_mpi PRIVATE ${MOE_CORE_LINK})
target_include_directories(test_comm_mpi PRIVATE ${CMAKE_SOURCE_DIR}/src)
target_compile_options(test_comm_mpi PRIVATE ${MOE_WARNINGS})

set(MOE_RUN_MPI bash ${CMAKE_CURRENT_LIST_DIR}/run_mpi.sh ${MPIEXEC_EXECUTABLE})
set(MOE_COMM_MPI $<TARGET_FILE:test_comm_mpi>)

# Every collective against local references, with 2 and 4 ranks.
foreach(np 2 4)
  add_test(NAME mpi_comm_np${np} COMMAND ${MOE_RUN_MPI} ${np} ${MOE_COMM_MPI} check)
  set_tests_properties(mpi_comm_np${np} PROPERTIES PROCESSORS ${np})
endforeach()

# Rank 1 hangs: the watchdog (2 s) of another rank prints its line and the job ends.
set(MOE_HANG_LINE "moe-train: rank [023]: all_reduce_sum did not complete within 2 s ")
string(APPEND MOE_HANG_LINE "\\(a peer rank died or hangs\\); aborting")
add_test(NAME mpi_comm_hang
         COMMAND ${MOE_RUN_MPI} 4 ${MOE_COMM_MPI} hang --expect-failure "${MOE_HANG_LINE}" 15)
# The same with MPI_THREAD_SERIALIZED (MOE_MPI_THREAD_LEVEL): the watchdog may not call MPI_Abort
# from its thread, so the rank _exits; mpirun must still end the job within the bound. The
# collectives pass at that level too.
add_test(NAME mpi_comm_hang_serialized
         COMMAND ${MOE_RUN_MPI} 2 ${MOE_COMM_MPI} hang --expect-failure "${MOE_HANG_LINE}" 15)
add_test(NAME mpi_comm_serialized_np2 COMMAND ${MOE_RUN_MPI} 2 ${MOE_COMM_MPI} check)
set_tests_properties(mpi_comm_hang_serialized mpi_comm_serialized_np2 PROPERTIES
                     ENVIRONMENT "MOE_MPI_THREAD_LEVEL=serialized" PROCESSORS 2)
# Rank 1 throws mid-run (timeout 60 s): mpirun ends the job long before any watchdog would.
add_test(NAME mpi_comm_rank_exit
         COMMAND ${MOE_RUN_MPI} 4 ${MOE_COMM_MPI} exit --expect-failure
                 "error: rank 1: deliberate failure on rank 1 mid-run" 15 --not "did not complete")
# A failed MPI call is a CommError naming the operation, and the job ends.
add_test(NAME mpi_comm_mpi_error
         COMMAND ${MOE_RUN_MPI} 2 ${MOE_COMM_MPI} mpi_error --expect-failure
                 "error: rank 1: MPI error in broadcast \\(MPI_Bcast" 15 --not "did not complete")

# Data-parallel training with the real binary (tests/mpi/dp_train.sh): per-step losses of ZeRO
# stages 0-2 on 2 and 4 ranks against one rank with the same global batch, N -> M rank resume,
# a rank killed with SIGKILL mid-run, and ranks launched with different configs.
set(MOE_DP_TRAIN bash ${CMAKE_CURRENT_LIST_DIR}/dp_train.sh ${MPIEXEC_EXECUTABLE}
                 $<TARGET_FILE:moe-train> ${CMAKE_SOURCE_DIR})
add_test(NAME mpi_dp_equal_np2 COMMAND ${MOE_DP_TRAIN} equal 2)
add_test(NAME mpi_dp_equal_np4 COMMAND ${MOE_DP_TRAIN} equal 4)
add_test(NAME mpi_dp_resume COMMAND ${MOE_DP_TRAIN} resume)
add_test(NAME mpi_dp_shards COMMAND ${MOE_DP_TRAIN} shards)
add_test(NAME mpi_dp_kill COMMAND ${MOE_DP_TRAIN} kill)
# A stop signal to one rank stops both after the same step, with a checkpoint to resume from.
add_test(NAME mpi_dp_stop COMMAND ${MOE_DP_TRAIN} stop)
# Ranks given different configs stop at start-up with one message naming the key.
add_test(NAME mpi_dp_mismatch COMMAND ${MOE_DP_TRAIN} mismatch)
# A save that meets non-finite weights on rank 0 stops both ranks, each with its own message.
add_test(NAME mpi_dp_diverged COMMAND ${MOE_DP_TRAIN} diverged)
set_tests_properties(mpi_dp_equal_np2 mpi_dp_shards mpi_dp_kill mpi_dp_stop mpi_dp_mismatch
                     mpi_dp_diverged PROPERTIES PROCESSORS 2)
set_tests_properties(mpi_dp_equal_np4 mpi_dp_resume PROPERTIES PROCESSORS 4)

# The same equivalences on 2 GPU ranks over NCCL (label gpu: skipped, exit 77, without 2 GPUs).
if(MOE_CUDA)
  add_test(NAME gpu_mpi_dp_equal_np2
           COMMAND ${CMAKE_COMMAND} -E env MOE_DP_DEVICE=cuda ${MOE_DP_TRAIN} equal 2)
  set_tests_properties(gpu_mpi_dp_equal_np2 PROPERTIES LABELS "gpu;mpi" SKIP_RETURN_CODE 77
                       TIMEOUT 300 PROCESSORS 2)
endif()

set(MOE_MPI_TESTS mpi_comm_np2 mpi_comm_np4 mpi_comm_hang mpi_comm_hang_serialized
                  mpi_comm_serialized_np2 mpi_comm_rank_exit mpi_comm_mpi_error
                  mpi_dp_equal_np2 mpi_dp_equal_np4 mpi_dp_resume mpi_dp_shards mpi_dp_kill
                  mpi_dp_stop mpi_dp_mismatch mpi_dp_diverged)
set_tests_properties(${MOE_MPI_TESTS} PROPERTIES LABELS "cpu;mpi" TIMEOUT 150)
set_tests_properties(mpi_comm_hang mpi_comm_rank_exit PROPERTIES PROCESSORS 4)
set_tests_properties(mpi_comm_mpi_error PROPERTIES PROCESSORS 2)
if(MOE_SANITIZE)
  # Open MPI's own allocations at exit are not ours to fix.
  set_property(TEST ${MOE_MPI_TESTS} APPEND PROPERTY ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0")
endif()
