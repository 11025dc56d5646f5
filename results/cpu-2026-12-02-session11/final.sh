#!/bin/bash
cd /tmp/final-tree
vmstat 15 > /tmp/cpu11/vmstat-final.log 2>&1 &
VM=$!
export PYTHONPATH=/tmp/final-tree
/work/main/.venv/bin/python -m tandem bench speed --speculation fixed,adaptive --ks 0,1,2,3 --batches 1,8,32 --max-tokens 96 --requests-per-batch 3 --repeats 2 --workload mixed --out /tmp/cpu11/final-mixed > /tmp/cpu11/final-mixed.log 2>&1
/work/main/.venv/bin/python -m tandem bench speed --speculation fixed,adaptive --ks 0,3 --batches 1,8,32 --max-tokens 96 --requests-per-batch 3 --repeats 2 --synthetic-acceptance 0.02 --synthetic-acceptance 0.92,0.72,0.36 --out /tmp/cpu11/final-synth > /tmp/cpu11/final-synth.log 2>&1
kill $VM
date > /tmp/cpu11/final.done
