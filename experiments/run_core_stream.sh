#!/bin/bash
# Issue 3's streams on the default pair (results/core/NAME/); see run_stream.sh.
#   bash experiments/run_core_stream.sh spd_dm 0 method=spd_dm
#   bash experiments/run_core_stream.sh omnidraft 1 method=omnidraft
#   bash experiments/run_core_stream.sh cache_pp 0 ablation=cache_pp     (dm_only, lora likewise)
exec bash "$(dirname "$0")/run_stream.sh" core "$@"
