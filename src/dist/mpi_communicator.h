// The MPI side of process groups: starting MPI when the program was launched by mpirun,
// communicators over MPI_COMM_WORLD and its splits, and ending the whole job when one
// rank fails.
//
// Each MpiCommunicator owns one worker thread that issues its collectives in submission
// order (every rank submits the same operations in the same order, as MPI requires), so
// the caller never blocks on the wire until it waits; several communicators run
// concurrently (MPI_THREAD_MULTIPLE). Sends and receives are posted at once from the
// calling thread (MPI_Isend, MPI_Irecv): a pipeline's stages order them differently, and
// queued behind one another on a worker they could wait for each other forever. Errors are returned by MPI (MPI_ERRORS_RETURN) and
// rethrown by Work::wait() with the communicator's name and MPI's message.
#pragma once
#include <memory>
#include <string>

#include "dist/communicator.h"

namespace tally::dist::mpi {

// Whether this process was started by mpirun (or another MPI launcher).
bool launched_by_mpirun();
// Starts MPI once per process (MPI_THREAD_MULTIPLE) and arranges MPI_Finalize at exit.
void initialize();
int world_rank();
int world_size();
// A communicator over all processes.
std::unique_ptr<Communicator> world(const std::string& name = "world");
// Splits `parent` (an MPI communicator): processes with the same `color` form a group,
// ordered by `key` (MPI_Comm_split). Collective over `parent`.
std::unique_ptr<Communicator> split(Communicator& parent, int color, int key, const std::string& name);
// Ends every process of the job now (MPI_Abort): a failing rank must not leave the others
// waiting in a collective forever.
[[noreturn]] void abort_job(int exit_code);

}  // namespace tally::dist::mpi
