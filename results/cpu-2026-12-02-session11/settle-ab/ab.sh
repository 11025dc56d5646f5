#!/bin/bash
# side by side: the settle rule (new) vs not (old), CPU, bundled model, mixed b8; alternating, twice each
cd /tmp
vmstat 15 > /tmp/cpu11/vmstat-ab.log 2>&1 &
VM=$!
for round in 1 2; do
for t in new old; do
  cd /tmp/$t-tree && PYTHONPATH=/tmp/$t-tree /work/main/.venv/bin/python -m tandem bench speed --speculation fixed,adaptive --ks 0,3 --batches 8 --max-tokens 96 --requests-per-batch 3 --repeats 2 --workload mixed --out /tmp/cpu11/ab-$t-$round > /tmp/cpu11/ab-$t-$round.log 2>&1
done
done
kill $VM
date > /tmp/cpu11/ab.done
