source .gpu/common.sh
part probe 150 python3 .gpu/s6probe2.py
part tests 240 python3 -m pytest -q tests/test_kernel_rows.py tests/test_lossless_rows.py tests/test_model_kernels.py tests/test_dsa_kernels.py tests/test_gpu_graphs.py tests/test_gpu.py
part rows 120 python3 -m tandem bench rows --device cuda --random-config v2-lite --quantization none,fp8 --batches 1,8,32 --prompt-tokens 1200 --out /tmp/rows
cp /tmp/rows/rows.md $OUT/rows.md 2>/dev/null
part fp8 200 python3 -m pytest -q -x tests/test_fp8_kernels.py tests/test_gpu_fp8.py tests/test_moe_kernels.py
tail -n 30 $OUT/tests.log | grep -v "^\.\|^s" ; tail -n 5 $OUT/fp8.log; cat $OUT/probe.log $OUT/rows.md; cat $OUT/parts.txt
