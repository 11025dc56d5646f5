# owed after session 39 (one GPU, ideally an H200): the GPU tests at the final tree (the early push's second part,
# DraftChain's device layout, served over the CUDA IPC ring), then issue 14's standard command with the push early
# and after the acceptance side by side, 0.85 and R1-like. ~560 s: split in two calls if the start is slow.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
git log --oneline -1 > $R/commit.txt 2>&1
part gtest 260 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_bridge.py tests/test_gpu.py tests/test_early_propose.py tests/test_draft_chain.py; snap
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --speculation fixed,fixed/accept-first --in-process --repeats 2"
part c85 150 python3 $S --synthetic-acceptance 0.85 --out $R/c85; snap
part r1 130 python3 $S --synthetic-acceptance 0.92,0.72,0.36 --out $R/r1; snap
for t in c85 r1; do echo "== $t"; grep -h "^| 0" $R/$t/speed.md | cut -d'|' -f2-7,10-15,21-; done
tail -3 $R/gtest.log; cat $OUT/parts.txt
