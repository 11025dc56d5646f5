# session 33, the short call (device time nearly spent): the GPU tests on this tree (session 31's GPU-path changes,
# the pushed bridge's CUDA streams over gloo on one GPU), then bench rows (must stay 0 modules differing)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
git log --oneline -1 > $R/commit.txt 2>&1
part tests 330 python3 -m pytest -q -x -p no:cacheprovider tests/test_bridge_generations.py tests/test_gpu_bridge.py tests/test_bridge_transport.py tests/test_lossless_rows.py tests/test_kernel_rows.py tests/test_gpu_fp8.py tests/test_gpu_graphs.py tests/test_model_kernels.py tests/test_bench_rows.py; snap
part rows 90 python3 -m tandem bench rows --device cuda --random-config v2-lite --quantization none,fp8 --batches 1,8,32 --out $R/rows; snap
tail -4 $R/tests.log; cut -c1-150 $R/rows/rows.md 2>/dev/null | head -30
cat $OUT/parts.txt
