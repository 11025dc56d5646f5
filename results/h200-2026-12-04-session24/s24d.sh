# session 24, call D: eager shapes over 1.15x size steps and 1 / 3 / many requests at start: the compile probe,
# issue 14's lines again (mixed prefill vs not, one run), and the GPU tests not yet run on this tree
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part cs 75 python3 .gpu/cs24.py; snap
grep -v "^20" $R/cs.log | grep -v "again" | head -30
part speed 210 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed,fixed/no-mixed --in-process --out $R/speed; snap
grep "^|" $R/speed.log | cut -d'|' -f2-5,7,9,13,14,17,18,20-25
part gt 285 python3 -m pytest -q tests/test_gpu_dsa.py tests/test_gpu_fp8.py tests/test_prefill_kernels.py tests/test_fused_layer.py tests/test_dsa_kernels.py -k "not flashinfer"; snap
tail -3 $R/gt.log
cat $OUT/parts.txt
