#!/bin/bash
# node-problem-detector custom plugin: is anything on this node's GPU stack broken, per gpudiag?
#
# It runs in NPD's own container, which has bash and no gpudiag, Python or network tools, so
# it only reads a file: the answer `gpudiag npd-relay`, a sidecar of NPD's pod running
# gpudiag's image, keeps there (deploy/kubernetes/npd/daemonset-patch.yaml). The relay asks
# the gpudiag daemon the node-health question on its socket (busy GPUs are healthy in use,
# so a busy node never turns GPUBlocked) and writes, atomically, two lines
# (gpudiag/core/npd.py):
#     gpudiag.npd/1 WRITTEN_AT_EPOCH_S EXIT_CODE
#     MESSAGE
# This script, gpudiag's image and the relay come from one image: they always agree on it.
#
# NPD's exit-code protocol: 0 OK, 1 NonOK (the GPUBlocked condition turns True), 2 Unknown.
# The first line of stdout is the condition's message (NPD keeps max_output_length = 80
# characters). No answer, a stale one (the relay stopped) or an unreadable one is Unknown:
# gpudiag not answering is not a broken GPU. Bash builtins only (no date, cat or stat): the
# tests run it with an empty PATH.
set -u
status_file=${GPUDIAG_NPD_STATUS_FILE:-/run/gpudiag/npd/status}
# The relay rewrites the file every 15 s; older than this and the relay has stopped.
max_age_s=${GPUDIAG_NPD_MAX_AGE_S:-60}
[[ $max_age_s =~ ^[0-9]{1,6}$ ]] || max_age_s=60

unknown() { local line="gpudiag: $1"; echo "${line:0:80}"; exit 2; }

[[ -f $status_file ]] || unknown "no answer from the npd-relay sidecar yet"
schema="" written="" rc="" message=""
{ IFS=' ' read -r -n 100 schema written rc; IFS= read -r -n 200 message; } 2>/dev/null \
    <"$status_file"
[[ $schema == gpudiag.npd/1 && $written =~ ^[0-9]{1,12}$ && $rc =~ ^[012]$ \
    && -n $message ]] || unknown "unreadable answer in $status_file"
printf -v now '%(%s)T' -1
age=$((now - 10#$written))
# A little slack for a clock step backwards; an answer from the future is not trusted.
((age <= max_age_s && age >= -5)) || unknown "the npd-relay answer is stale (over ${max_age_s}s)"
echo "${message:0:80}"
exit "$rc"
