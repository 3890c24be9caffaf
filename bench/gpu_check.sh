#!/usr/bin/env bash
# Kept for its old name: the GPU check is bench/gpu_oneshot.sh (see bench/README.md, "GPU kernels").
exec bash "$(dirname "$0")/gpu_oneshot.sh" "$@"
