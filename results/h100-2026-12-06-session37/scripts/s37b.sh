# session 37, call B (one GPU, the same machine right after A): the pair again in the other order (new first), and
# the R1-like profile for both trees. ~520 s. As s37a.sh (needs .gpu/base37.tgz).
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
mkdir -p /tmp/base && tar xzf .gpu/base37.tgz -C /tmp/base
(cd /tmp/base && python3 -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto)
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --repeats 2"
part new 240 python3 $S --out $R/new; snap
part base 240 bash -c "cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base python3 $S --out $R/base"; snap
for t in new base; do echo "== $t"; grep -h "^|" $R/$t/speed.md | cut -d'|' -f2-6,9-14,21-; done
cat $OUT/parts.txt
