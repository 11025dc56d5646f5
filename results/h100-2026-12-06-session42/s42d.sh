# session 42, call D: the early pass's step 0 and chain as one CUDA graph (new) -- the GPU files of the early pass
# first, then bundled-model speed against the session's start (old: 3ad5fd4's draft), alternating
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
part t 250 python3 -m pytest -q -rfE -x -p no:cacheprovider tests/test_early_propose.py tests/test_draft_chain.py tests/test_gpu_bridge.py tests/test_gpu.py; snap
tail -12 $R/t.log
M=checkpoints/tandem-code-mini
use() { for f in early engine chain server; do cp .gpu/draft_$1/$f.py services/draft/$f.py; done; }
for v in new old new old; do
  use $v
  part s_$v 90 python3 -m tandem bench speed --device cuda --model $M --ks 0,3 --batches 1,8 --max-tokens 64 --requests-per-batch 4 --repeats 2 --out $R/p_$v; snap
  echo "== $v"; grep -h "^served model" $R/s_$v.log | cut -c1-100
done
use new
cat $OUT/parts.txt
