# session 41, call A: the bundled model on the GPU at this tree (issue 18's GPU lines): steps with their kernels, speed
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
M=checkpoints/tandem-code-mini
part steps 150 python3 -m tandem bench steps --device cuda --model $M --batches 1,8,32 --kernels --top 22 --out $R/steps.json; snap
part speed 330 python3 -m tandem bench speed --device cuda --model $M --ks 0,3 --batches 1,8,32 --max-tokens 64 --repeats 2 --in-process --out $R/speed; snap
grep "^batch" $R/steps.log
grep -h "^|" $R/speed/speed.md | head -30
tail -5 $R/speed.log
cat $OUT/parts.txt
