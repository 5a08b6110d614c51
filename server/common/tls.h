// TLS for every Ember port, from PEM files.
//
// Servers: --tls_cert/--tls_key are the server's identity; with --tls_ca
// too, clients must present a certificate signed by that CA (mutual TLS).
// Clients (and servers calling other servers): --tls_ca verifies the peer
// (TLS is on when it is given); --tls_cert/--tls_key are presented as the
// client's certificate where the server asks for one. Certificates must
// name the addresses they are dialled by (e.g. an IP SAN 127.0.0.1).
//
// Without any of the files a port is plaintext: the default on 127.0.0.1
// (`emberctl up`); a server listening elsewhere without TLS logs a warning.
#ifndef EMBER_SERVER_COMMON_TLS_H_
#define EMBER_SERVER_COMMON_TLS_H_

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"

namespace ember {

struct TlsFiles {
  std::string cert;  // PEM certificate chain
  std::string key;   // PEM private key
  std::string ca;    // PEM root certificates that peers must chain to
};

// Plaintext credentials when no file is given. INVALID_ARGUMENT for a cert
// without its key (or the reverse), or a CA without a server identity;
// NOT_FOUND for an unreadable file.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFrom(
    const TlsFiles& files);
// nullptr (plaintext) when no CA is given.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFrom(
    const TlsFiles& files);

// Logs a warning when `listen` is not a loopback address and `tls` is off.
void WarnIfPlaintextOffLoopback(const std::string& listen, bool tls);

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_TLS_H_
