# session 24, call B: a step's Prefill riding the round's Verify (one forward): GPU tests, issue 14's lines with and
# without it side by side (one run, the same services), and which eager shapes compile kernels mid-serving
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gt 200 python3 -m pytest -q tests/test_gpu_graphs.py tests/test_gpu.py tests/test_lossless_rows.py tests/test_gpu_prefill.py tests/test_mixed_prefill.py -k "not flashinfer"; snap
part speed 235 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed,fixed/no-mixed --in-process --out $R/speed; snap
grep "^|" $R/speed.log | head -40
part cs 80 python3 .gpu/cs24.py; snap
cat $OUT/parts.txt
