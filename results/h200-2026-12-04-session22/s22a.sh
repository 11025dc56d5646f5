# session 22, call A: per-kernel step profile PDL on/off, a bf16 Triton GEMM for decode rows vs cuBLAS, GPU tests with PDL on
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part kpdl 50 python3 .gpu/kern22.py pdl
part knopdl 50 env TANDEM_PDL=0 python3 .gpu/kern22.py nopdl
grep "^==" $OUT/kpdl.log $OUT/knopdl.log
part gemv 130 python3 .gpu/gemv22.py
head -60 $OUT/gemv.log
part gt 230 python3 -m pytest -q -x tests/test_gpu_pdl.py tests/test_fused_layer.py tests/test_gpu_graphs.py tests/test_gpu.py tests/test_gpu_fp8.py tests/test_lossless_rows.py tests/test_draft_chain.py tests/test_kernel_rows.py -k "not flashinfer"
tail -4 $OUT/gt.log
part kt 120 python3 -m pytest -q -x tests/test_fp8_kernels.py tests/test_moe_kernels.py tests/test_model_kernels.py
tail -3 $OUT/kt.log
cp $OUT/*.log $OUT/*.txt $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
