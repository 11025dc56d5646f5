# session 42, call A: the draft's step laid out before the acceptance frame (new) against after it (old), bundled
# model, alternating; a phase timeline of the new; the GPU files of the draft's early pass and chain
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
M=checkpoints/tandem-code-mini
use() { for f in early engine chain server; do cp .gpu/draft_$1/$f.py services/draft/$f.py; done; }
for v in new old new old; do
  use $v
  part s_$v 100 python3 -m tandem bench speed --device cuda --model $M --ks 0,3 --batches 1,8 --max-tokens 64 --requests-per-batch 4 --repeats 2 --out $R/p_$v; snap
  grep -h "^served model" $R/s_$v.log
done
use new
OLDPP=$PYTHONPATH
export TANDEM_PHASES_DIR=$R/ph PYTHONPATH=$PWD/.gpu/site39:$OLDPP
part ph 90 python3 -m tandem bench speed --device cuda --model $M --ks 3 --batches 1 --max-tokens 64 --requests-per-batch 4 --out $R/p
unset TANDEM_PHASES_DIR; export PYTHONPATH=$OLDPP
python3 .gpu/phases39.py $R/ph > $R/phases.txt 2>&1; rm -rf $R/ph; snap
grep -v "^names" $R/phases.txt | head -45
part t 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_early_propose.py tests/test_draft_chain.py tests/test_gpu_bridge.py tests/test_bench_steps.py; snap
tail -6 $R/t.log
cat $OUT/parts.txt
