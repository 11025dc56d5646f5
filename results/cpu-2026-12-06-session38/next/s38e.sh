# session 38, call E (one GPU): the bridge tests after the shared-memory segments' new names (pid namespace and pid,
# the orphan sweep), CUDA IPC headers included. ~150 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part btest 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_bridge.py tests/test_propose_ahead.py tests/test_shm_orphans.py tests/test_bridge_transport.py
mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $R/; tail -3 $R/btest.log; cat $OUT/parts.txt
