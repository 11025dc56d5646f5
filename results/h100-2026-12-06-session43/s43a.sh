# session 43, call A: the early-pass GPU tests (round-8 cap, named host parts), issue 14's standard command at this
# tree (0.85 and R1-like), the bundled model at batches 1, 8, 32 (issue 18's line)
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
part t 120 python3 -m pytest -q -rfE -x -p no:cacheprovider tests/test_early_propose.py tests/test_draft_chain.py; snap
tail -4 $R/t.log
M=checkpoints/tandem-code-mini
part b 150 python3 -m tandem bench speed --device cuda --model $M --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 4 --repeats 2 --out $R/b; snap
grep -h "^served model\|^| " $R/b/speed.md 2>/dev/null | cut -c1-160 | head -12
grep -h "graphs ready" $R/b.log | head -4
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --speculation fixed --in-process --repeats 2"
part c85 170 python3 $S --synthetic-acceptance 0.85 --out $R/c85; snap
part r1 140 python3 $S --synthetic-acceptance 0.92,0.72,0.36 --out $R/r1; snap
for t in c85 r1; do echo "== $t"; grep -h "^| 0\|^| R1\|^| 0.92" $R/$t/speed.md | cut -d'|' -f2-7,10-15,21-; done
cat $OUT/parts.txt
