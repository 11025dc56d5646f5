#!/bin/bash
# A/B on this CPU at batch 8 and 32 (tiny random preset, synthetic acceptance 0.85): rows pushed before the
# acceptance (this tree) against after it (base = 7cf464f), alternating trees.
OUT=/work/main/results/cpu-2026-12-05-session36/ab32bb
mkdir -p $OUT
PY=/work/main/.venv/bin/python
CMD="-m tandem bench speed --random-config tiny --ks 0,3 --batches 32 --max-tokens 256 --requests-per-batch 2 --synthetic-acceptance 0.85 --speculation fixed --repeats 3"
for i in 1 2 3; do
  for t in base new; do
    d=/tmp/base; [ $t = new ] && d=/work/main
    s=$(date +%s)
    (cd $d && $PY $CMD --out $OUT/$t$i > $OUT/$t$i.log 2>&1)
    echo "$t$i rc=$? $(( $(date +%s) - s ))s" >> $OUT/parts.txt
  done
done
