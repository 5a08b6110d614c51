// emberctl's cluster commands: servers (coordinator, worker, up) and client
// calls against a running deployment (create, live plan, status, lookup,
// apply-gradients, export, checkpoint, checkpoints, restore, drain, calibrate). Each returns the process exit status.
#ifndef EMBER_CLI_CLUSTER_COMMANDS_H_
#define EMBER_CLI_CLUSTER_COMMANDS_H_

#include <string>

namespace ember {
namespace cli {

// Blocks SIGINT/SIGTERM in every thread started afterwards, so the server
// commands can wait for them with sigwait. Call first thing in main.
void BlockTerminationSignals();

int RunCoordinator();
int RunWorker();
int RunUp(const std::string& self_path);
int RunCreate();
int RunLivePlan();
int RunStatus();
int RunLookup();
int RunApplyGradients();
int RunExport();
int RunCheckpoint();
int RunCheckpoints();
int RunRestore();
int RunDrain();
int RunScale();
int RunSetTrainers();
int RunCalibrate();
// emberctl tokens --dir=DIR [--workers=N | --worker_names=A,B,...]: fresh
// random token files for token authentication (server/common/auth.h).
int RunTokens();

}  // namespace cli
}  // namespace ember

#endif  // EMBER_CLI_CLUSTER_COMMANDS_H_
