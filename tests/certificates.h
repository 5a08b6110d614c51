// Test certificates made with openssl: a CA and certificates it signs,
// usable by servers and clients alike.
#ifndef EMBER_TESTS_CERTIFICATES_H_
#define EMBER_TESTS_CERTIFICATES_H_

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace ember {
namespace testing_util {

// dir/<name>.pem and dir/<name>.key: a certificate (CN=<name>) naming
// `subject_alt_names` (e.g. "IP:127.0.0.1,DNS:localhost"), signed by the CA
// at dir/<ca>-ca.pem and dir/<ca>-ca.key. False when openssl failed.
inline bool IssueCertificate(const std::string& dir, const std::string& ca,
                             const std::string& name, const std::string& subject_alt_names) {
  const std::string p = dir + "/" + name, c = dir + "/" + ca;
  const std::string cmd = absl::StrCat(
      "set -e; cd ", dir, "; ",
      "openssl req -newkey rsa:2048 -nodes -keyout ", p, ".key -out ", p,
      ".csr -subj /CN=", name, " 2>/dev/null; ",
      "printf 'subjectAltName=", subject_alt_names, "\\n' > ", p, ".ext; ",
      "openssl x509 -req -in ", p, ".csr -CA ", c, "-ca.pem -CAkey ", c,
      "-ca.key -CAcreateserial -out ", p, ".pem -days 2 -extfile ", p, ".ext 2>/dev/null");
  return std::system(cmd.c_str()) == 0;
}

// dir/<name>-ca.pem (a new CA), and dir/<name>.pem and dir/<name>.key (a
// certificate of that CA, IssueCertificate's). False when openssl failed.
inline bool MakeCertificates(const std::string& dir, const std::string& name,
                             const std::string& subject_alt_names) {
  const std::string p = dir + "/" + name;
  const std::string cmd = absl::StrCat(
      "set -e; cd ", dir, "; ",
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ", p, "-ca.key -out ", p,
      "-ca.pem -days 2 -subj /CN=", name, "-ca 2>/dev/null");
  return std::system(cmd.c_str()) == 0 && IssueCertificate(dir, name, name, subject_alt_names);
}

}  // namespace testing_util
}  // namespace ember

#endif  // EMBER_TESTS_CERTIFICATES_H_
