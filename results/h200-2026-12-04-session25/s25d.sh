# session 25, call D: the attention kernel's split count and table width unspecialized + a decode-form eager step at
# start: the first-row stall probe again (fresh Triton cache), the no-compile test, the kernel / graph / lossless tests
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
export BATCHES=32
part pfb 100 python3 .gpu/pf25b.py; snap
grep "SLOW\|pass 2" $R/pfb.log
part gt 300 python3 -m pytest -q tests/test_gpu_graphs.py tests/test_triton_kernels.py tests/test_lossless_rows.py tests/test_kernel_rows.py tests/test_gpu_dsa.py tests/test_mixed_prefill.py -k "not flashinfer"; snap
tail -15 $R/gt.log
cat $OUT/parts.txt
