# session 27's plan for the next H200 (no device was lent in session 27), call A: GPU tests of this tree's bridge,
# lane, layout and draft code; the verify step's wall with the layout of 022d37c (old: pageable upload + casts) and
# 8f46015 (new: one pinned upload, views made once), three alternating processes each (step23.py); where the
# draft's CUDA IPC take and the step layout spend their host time (mb27.py)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gt 240 python3 -m pytest -q tests/test_gpu_bridge.py tests/test_gpu.py tests/test_draft_chain.py tests/test_gpu_graphs.py tests/test_local_lane.py -k "not flashinfer"; snap
tail -2 $R/gt.log; grep -E "^(FAILED|ERROR)" $R/gt.log | head
FILES="models/batch.py models/cuda_graphs.py services/draft/chain.py"
use() { for f in $FILES; do cp .gpu/t27/$1/$f $f; done; }
for i in 1 2 3; do for t in old new; do use $t; part step-$t$i 50 python3 .gpu/step23.py $t$i; snap; done; done
use new; grep -h "^==" $R/step-*.log | sort -k3,3 -k5,5n -k7,7n
part mb 80 python3 .gpu/mb27.py $R/mb27.json; snap
grep -E "^(take|prepare)" $R/mb.log
cat $OUT/parts.txt
