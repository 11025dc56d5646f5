source .gpu/common.sh
# the tree before the layer fusions, for side-by-side step times in this call
rm -rf /tmp/old && mkdir -p /tmp/old && cp -a . /tmp/old/ && cp -r .gpu/old/. /tmp/old/ && rm -rf /tmp/old/checkpoints
part tests 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_fused_layer.py tests/test_lossless_rows.py tests/test_kernel_rows.py tests/test_gpu_graphs.py tests/test_draft_chain.py tests/test_gpu.py "tests/test_model_kernels.py" -k "not flashinfer"
part fp8new 90 python3 -m tandem bench fp8 --parts v2lite --out /tmp/fnew
part fp8old 90 bash -c "cd /tmp/old && python3 -m tandem bench fp8 --parts v2lite --out /tmp/fold"
mkdir -p $OUT/new $OUT/old; cp /tmp/fnew/fp8.* $OUT/new/ 2>/dev/null; cp /tmp/fold/fp8.* $OUT/old/ 2>/dev/null
part prof 90 python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0,3 --batches 1 --max-tokens 32 --out $OUT/profile
tail -3 $OUT/tests.log; grep -A8 "^| weights" /tmp/fnew/fp8.md; grep -A8 "^| weights" /tmp/fold/fp8.md; head -1 $OUT/profile/*.txt; cat $OUT/parts.txt
