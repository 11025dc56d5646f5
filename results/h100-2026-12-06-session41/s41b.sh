# session 41, call B: where a bundled-model batch-1 K = 3 round goes (site39 phase probe), and the owed GPU test files
# that need no FlashInfer (the model-kernel file's tail, DSA, prefill)
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
cat $OUT/gpu.txt
M=checkpoints/tandem-code-mini
OLDPP=$PYTHONPATH
export TANDEM_PHASES_DIR=$R/ph PYTHONPATH=$PWD/.gpu/site39:$OLDPP
part ph 100 python3 -m tandem bench speed --device cuda --model $M --ks 3 --batches 1 --max-tokens 64 --requests-per-batch 4 --out $R/p
unset TANDEM_PHASES_DIR; export PYTHONPATH=$OLDPP
python3 .gpu/phases39.py $R/ph > $R/phases.txt 2>&1; rm -rf $R/ph; snap
grep -v "^names" $R/phases.txt | head -80
part tk 330 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_model_kernels.py tests/test_gpu_dsa.py tests/test_gpu_prefill.py tests/test_bench_steps.py; snap
tail -15 $R/tk.log
cat $OUT/parts.txt
