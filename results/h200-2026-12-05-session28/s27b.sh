# session 27's plan, call B: the served round's phases at batch 32 and 1, K = 3 (does the collect hand-off fall
# now that the draft's push lane no longer spins? the draft's step-0 layout and chain fill?), then issue 14's
# standard command with --in-process
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
( export PYTHONPATH=$PWD/.gpu/site:$PYTHONPATH
  TANDEM_PHASES_DIR=$R/ph part ph 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches 32,1 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --speculation fixed --out $R/phspeed )
python3 .gpu/phases26.py $R/ph > $R/phases.txt 2>&1; gzip -q $R/ph/*.jsonl; snap
grep -E "==|ipc_take|take_later|draft_gather|step0|fill|draft_total|collect_end|push_arrival|next_verify_after_compute" $R/phases.txt
part s64 260 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s64; snap
grep "^|" $R/s64.log | cut -d'|' -f2-5,7,9-14,17,18,20-25
cat $OUT/parts.txt
