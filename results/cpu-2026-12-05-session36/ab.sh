#!/bin/bash
# A/B on this CPU: the Verify's rows pushed before its acceptance (this tree) against after it (base = HEAD 7cf464f),
# issue 14's CPU line command, alternating trees.
OUT=/work/main/results/cpu-2026-12-05-session36/ab
mkdir -p $OUT
PY=/work/main/.venv/bin/python
CMD="-m tandem bench speed --ks 0,3 --batches 1 --max-tokens 64 --requests-per-batch 6 --repeats 2 --in-process"
for i in 1 2; do
  for t in base new; do
    d=/tmp/base; [ $t = new ] && d=/work/main
    s=$(date +%s)
    (cd $d && $PY $CMD --out $OUT/$t$i > $OUT/$t$i.log 2>&1)
    echo "$t$i rc=$? $(( $(date +%s) - s ))s" >> $OUT/parts.txt
  done
done
