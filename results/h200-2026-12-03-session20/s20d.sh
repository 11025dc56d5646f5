# session 20, call D: the GPU tests on the final tree (bridge test fixed: the poisoned frame is one of the eight)
source .gpu/common.sh
part gt 230 python3 -m pytest -q tests/test_gpu_bridge.py tests/test_kernel_rows.py tests/test_draft_chain.py tests/test_gpu.py -k "not flashinfer"
tail -8 $OUT/gt.log
cat $OUT/parts.txt
