# session 26, call B: the served round's phases, every process (.gpu/site/sitecustomize.py: TANDEM_PHASES_DIR), batch 1
# and 32, K = 0 and 3; then issue 14's batch-32 rows with 256 new tokens a request (drain and prefill share smaller)
source .gpu/common.sh
export PYTHONPATH=$PWD/.gpu/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
TANDEM_PHASES_DIR=$R/ph part ph 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32,1 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --speculation fixed --out $R/phspeed; snap
ls -la $R/ph; grep "^|" $R/ph.log | cut -d'|' -f2-14
part mt256 300 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32 --max-tokens 256 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/mt256; snap
grep "^|" $R/mt256.log | cut -d'|' -f2-5,7,9,13,14,17,18,20-25
cat $OUT/parts.txt
