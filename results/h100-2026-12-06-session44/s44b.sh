# session 44, call B: the GPU tests owed: tests/test_gpu_fp8.py whole (session 41: only its first 8 ran), and the early
# pass / chain tests at this tree (session 43's review edit of early.lay_out had not run on a GPU)
WHL=.whl-lite source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
part e 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_early_propose.py tests/test_draft_chain.py; snap
part f8 400 python3 -m pytest -v -rfE -p no:cacheprovider --durations=15 tests/test_gpu_fp8.py; snap
grep -h "passed\|failed\|PASSED\|FAILED\|SKIPPED" $R/e.log $R/f8.log | tail -40
cat $OUT/parts.txt
cd $OUT && tar czf r.tgz r && rm -rf r
