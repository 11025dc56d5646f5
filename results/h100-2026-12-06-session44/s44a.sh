# session 44, call A: issue 14's standard command (0.85, R1-like), the bundled model at batches 1, 8, 32 (issue 18),
# GPU tests (capture memory on one stream, fp8 whole), issue 15's V2-Lite step and the bundled model's fp8 accuracy
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --speculation fixed --in-process --repeats 2"
part c85 170 python3 $S --synthetic-acceptance 0.85 --out $R/c85; snap
part r1 140 python3 $S --synthetic-acceptance 0.92,0.72,0.36 --out $R/r1; snap
for t in c85 r1; do echo "== $t"; grep -h "^| 0\|^| R1\|^| 0.92" $R/$t/speed.md | cut -d'|' -f2-7,10-15,21-; done
M=checkpoints/tandem-code-mini
part b 120 python3 -m tandem bench speed --device cuda --model $M --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 4 --repeats 2 --out $R/b; snap
grep -h "^served model\|^| " $R/b/speed.md 2>/dev/null | cut -c1-160 | head -12
part t 100 python3 -m pytest -q -rfE -s -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_fp8.py; snap
grep -h "captures:\|passed\|failed" $R/t.log | tail -5
part f 110 python3 -m tandem bench fp8 --device cuda --parts v2lite,accuracy --out $R/f; snap
cat $R/f/fp8.md 2>/dev/null | head -40
cat $OUT/parts.txt
cd $OUT && tar czf r.tgz r && rm -rf r
