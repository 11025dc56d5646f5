source .gpu/common.sh
for b in 1 32; do
export TANDEM_PROFILE_DIR=/tmp/r/trace$b TANDEM_PROFILE_CALLS=40,10
part speed$b 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 3 --batches $b --max-tokens 64 --requests-per-batch 2 --out /tmp/r/speed$b
unset TANDEM_PROFILE_DIR
grep "^|" /tmp/r/speed$b/speed.md | cut -d'|' -f2-20
python3 .gpu/trace16.py /tmp/r/trace$b/*.json.gz
for f in /tmp/r/trace$b/*.txt; do echo "== $f"; head -30 $f | cut -c1-170; done
done
cp $OUT/*.log /tmp/r/ 2>/dev/null; rm -f /tmp/r/trace*/*.json.gz; tar czf $OUT/r.tgz -C /tmp r; rm -f $OUT/*.log
cat $OUT/parts.txt
