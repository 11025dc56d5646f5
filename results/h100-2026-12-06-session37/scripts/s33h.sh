# session 33, for nvidia-h200-x2 (target cuda:0, draft cuda:1, NCCL bridge): the pushed NCCL rows first (their
# tests, then `tandem bench bridge --device cuda`: send to rows at the draft, the landed take, a bare one-way send),
# then issue 14's standard command served vs in-process, then session 31's two micro-batches alternating (s32h)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
git log --oneline -1 > $R/commit.txt 2>&1
part tests 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_bridge_generations.py tests/test_gpu_bridge.py tests/test_bridge_transport.py tests/test_gpu.py; snap
part bridge 60 python3 -m tandem bench bridge --device cuda --out $R/bridge; snap
part std 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/std; snap
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --synthetic-acceptance 0.85 --speculation fixed,fixed/halves"
part h64 100 $S --batches 32 --max-tokens 64 --requests-per-batch 2 --out $R/h64; snap
tail -4 $R/tests.log; cat $R/bridge/bridge.md; grep -h "^|" $R/std/speed.md $R/h64/speed.md | cut -d'|' -f2-16
cat $OUT/parts.txt
