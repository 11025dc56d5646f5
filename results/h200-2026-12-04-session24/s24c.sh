# session 24, call C: eager size classes warmed at start + grouping/acceptance kernels not specialized on sizes:
# the compile probe again, issue 14's lines (mixed prefill vs not, one run), GPU tests of the changed kernels
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part cs 90 python3 .gpu/cs24.py; snap
grep -v "^20" $R/cs.log | head -40
part speed 235 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed,fixed/no-mixed --in-process --out $R/speed; snap
grep "^|" $R/speed.log | cut -d'|' -f2-5,7,9,13,14,17,18,20-25
grep -h "captured" $R/*.log | head -4
part gt 200 python3 -m pytest -q tests/test_triton_kernels.py tests/test_moe_kernels.py tests/test_engines.py tests/test_gpu_graphs.py tests/test_draft_chain.py -k "not flashinfer"; snap
cat $OUT/parts.txt
