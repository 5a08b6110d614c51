// emberctl's exit statuses and failure report, shared by its commands.
#ifndef EMBER_CLI_EXIT_STATUS_H_
#define EMBER_CLI_EXIT_STATUS_H_

#include <iostream>
#include <string>

#include "absl/status/status.h"

namespace ember {
namespace cli {

constexpr int kExitFailure = 1;  // the request failed
constexpr int kExitUsage = 2;    // bad usage

// Prints "emberctl COMMAND: CODE: message" to stderr; returns kExitFailure.
inline int Fail(const std::string& command, const absl::Status& status) {
  std::cerr << "emberctl " << command << ": " << absl::StatusCodeToString(status.code()) << ": "
            << status.message() << std::endl;
  return kExitFailure;
}

}  // namespace cli
}  // namespace ember

#endif  // EMBER_CLI_EXIT_STATUS_H_
