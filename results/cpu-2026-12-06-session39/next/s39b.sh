# session 39, call B (one GPU): the GPU tests at this tree (the early push is the default now), then the 0.85
# standard command with the two modes in the other order (accept-first first), batch 32 only. ~480 s.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
git log --oneline -1 > $R/commit.txt 2>&1
part gtest 330 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu.py tests/test_gpu_graphs.py tests/test_model_kernels.py tests/test_early_propose.py tests/test_draft_chain.py tests/test_lossless_rows.py tests/test_gpu_bridge.py; snap
part rev 130 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32 --max-tokens 64 --requests-per-batch 3 --speculation fixed/accept-first,fixed --repeats 2 --synthetic-acceptance 0.85 --out $R/rev; snap
grep -h "^|" $R/rev/speed.md | cut -d'|' -f2-7,9-14
cat $OUT/parts.txt
