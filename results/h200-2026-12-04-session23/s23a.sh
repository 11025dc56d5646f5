# session 23, call A: the verify step's wall with three trees in alternating processes (old: f55a545's CPU-tensor
# layout; mid: d8402b0's host lists; new: the layout staged into the graph's buffers, ids in the same transfer),
# the host timeline of the new tree, the GPU tests of the new tree, issue 14's lines. r.tgz rebuilt after each part.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
FILES="models/kv_cache.py models/cuda_graphs.py models/runner.py services/target/engine.py services/draft/engine.py services/draft/chain.py"
use() { for f in $FILES; do cp .gpu/t23/$1/$f $f; done; }
for i in 1 2 3; do
  for t in old mid new; do use $t; part step-$t$i 60 python3 .gpu/step23.py $t$i; snap; done
done
use new; git status --short | head
grep -h "^==" $R/step-*.log | sort -k3,3 -k5,5n -k7,7n
part host 60 python3 .gpu/host22.py; snap
grep -A3 "^== one step" $R/host.log
part gt 230 python3 -m pytest -q tests/test_gpu_graphs.py tests/test_gpu.py tests/test_lossless_rows.py tests/test_draft_chain.py tests/test_gpu_bridge.py tests/test_kernel_rows.py -k "not flashinfer"; snap
tail -3 $R/gt.log
part speed 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --in-process --out $R/speed; snap
grep "^|" $R/speed.log | cut -d'|' -f2-5,7,9,12-14,20-26
cat $OUT/parts.txt
