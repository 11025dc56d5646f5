source .gpu/common.sh
rm -rf /tmp/old && mkdir -p /tmp/old && cp -a . /tmp/old/ && cp -r .gpu/old/. /tmp/old/ && rm -f /tmp/old/kernels/triton_mla_write.py
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 0,3 --batches 32 --max-tokens 64 --requests-per-batch 2"
part old 100 bash -c "cd /tmp/old && $S --out /tmp/r/old"
part new 100 $S --out /tmp/r/new
for d in old new; do grep "^|" /tmp/r/$d/speed.md | cut -c1-260; done
cp $OUT/*.log /tmp/r/ 2>/dev/null; tar czf $OUT/r.tgz -C /tmp r; rm -f $OUT/*.log; cat $OUT/parts.txt
