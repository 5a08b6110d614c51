// libFuzzer target: the text formats Ember reads: checkpoint MANIFESTs,
// KJT and KeyedTensor JSON (emberctl lookup/apply-gradients), collection
// specs in JSON (emberctl create/plan) with the planner's spec validation,
// and the KJT layout check.
#include <cstdint>
#include <string>

#include "cli/json_io.h"
#include "cli/spec_io.h"
#include "client/kjt.h"
#include "planner/spec_validation.h"
#include "server/checkpoint/checkpoint_files.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      (void)ember::checkpoint::ParseManifest(text, "MANIFEST");
      break;
    case 1: {
      auto kjt = ember::cli::ParseKjtJson(text);
      if (kjt.ok()) {
        (void)kjt->Validate();
        (void)kjt->key_offsets();
      }
      break;
    }
    case 2: {
      auto kt = ember::cli::ParseKeyedTensorJson(text);
      if (kt.ok()) (void)ember::client::CheckGradientLayout(*kt, kt->keys, kt->length_per_key,
                                                            kt->batch_size);
      break;
    }
    default: {
      auto spec = ember::cli::ParseCollectionSpecJson(text);
      if (spec.ok()) (void)ember::planner::ValidateCollectionSpec(*spec);
    }
  }
  return 0;
}
