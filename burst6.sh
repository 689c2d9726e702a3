set -uo pipefail
OUT=$OUT bash ci/gpu_t1_chunk.sh 2>&1 | tail -45
echo "=== recurrent tests (facade / routing / FLA adapter / torch.compile with the bulk-ring schedule)"
RECURRENT_STAGES=tests OUT=$OUT timeout 200 bash ci/gpu_recurrent.sh 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
