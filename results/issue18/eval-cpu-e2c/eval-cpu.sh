# session 25: the second edition's third run (e2c, trained in call T) on this 2-core CPU
cd /work/main
M=/work/ck2/tandem-code-mini; O=results/issue18
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
log 1. acceptance; .venv/bin/python -m tandem bench acceptance --model $M --max-k 3 --out $O/acceptance-e2c-lineend 2>&1 | grep -v "INFO\|WARN" | tail -12
log 2. nextline; .venv/bin/python -m tandem bench nextline --model $M --docs 100 --out $O/nextline-e2c 2>&1 | tail -12
log 3. steps; .venv/bin/python -m tandem bench steps --model $M --batches 1,8,32 --out $O/eval-cpu-e2c/steps-cpu.json 2>&1 | tail -4
log 4. speed; .venv/bin/python -m tandem bench speed --model $M --ks 0,3 --batches 1,8,32 --max-tokens 64 --repeats 2 --out $O/eval-cpu-e2c/speed-new 2>&1 | grep "^|" | head -10
log done
