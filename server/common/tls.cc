#include "server/common/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ember {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string pem = ss.str();
  if (!absl::StrContains(pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is not PEM"));
  }
  return pem;
}

absl::Status CheckPair(const TlsFiles& f) {
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFrom(
    const TlsFiles& f) {
  if (absl::Status s = CheckPair(f); !s.ok()) return s;
  if (f.cert.empty()) {
    if (!f.ca.empty()) {
      return absl::InvalidArgumentError("--tls_ca on a server needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  auto cert = ReadPem(f.cert, "certificate");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(f.key, "private key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions o;
  o.pem_key_cert_pairs.push_back({*key, *cert});
  if (!f.ca.empty()) {
    auto ca = ReadPem(f.ca, "CA certificate");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
    o.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFrom(
    const TlsFiles& f) {
  if (absl::Status s = CheckPair(f); !s.ok()) return s;
  if (f.ca.empty()) return std::shared_ptr<grpc::ChannelCredentials>();
  grpc::SslCredentialsOptions o;
  auto ca = ReadPem(f.ca, "CA certificate");
  if (!ca.ok()) return ca.status();
  o.pem_root_certs = *ca;
  if (!f.cert.empty()) {
    auto cert = ReadPem(f.cert, "certificate");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(f.key, "private key");
    if (!key.ok()) return key.status();
    o.pem_cert_chain = *cert;
    o.pem_private_key = *key;
  }
  return grpc::SslCredentials(o);
}

void WarnIfPlaintextOffLoopback(const std::string& listen, bool tls) {
  if (tls) return;
  const std::string host = listen.substr(0, listen.rfind(':'));
  if (host == "127.0.0.1" || host == "localhost" || host == "[::1]") return;
  LOG(WARNING) << "listening on " << listen << " without TLS: tokens and embeddings cross the "
               << "network in plaintext (give --tls_cert/--tls_key, and --tls_ca for mutual TLS)";
}

}  // namespace ember
