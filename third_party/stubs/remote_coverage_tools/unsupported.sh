#!/bin/sh
echo "bazel coverage is not supported in the offline Ember build" >&2
exit 1
