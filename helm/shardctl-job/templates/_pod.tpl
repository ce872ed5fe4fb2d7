{{- /*
Pod parts both job kinds share. They mirror the helpers of
shardctl.orchestrator.clusters.k8s.objects (pod_volumes, volume_mounts,
container_security, pod_security, pod_placement); tests/test_helm_chart.py
compares the rendered objects with the Python renderer's.
*/ -}}

{{- define "shardctl-job.command" -}}
# The PyTorchJob operator sets RANK to the node rank and WORLD_SIZE to the node count;
# both are removed so nothing mistakes them for a process's own. torchrun gets its
# node rank and counts from the PET_* variables.
["env", "-u", "RANK", "-u", "WORLD_SIZE", "bash", "/etc/shardctl/launch.sh"]
{{- end -}}

{{- define "shardctl-job.env" -}}
{{- range $key, $value := .Values.env }}
- name: {{ $key | quote }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{- define "shardctl-job.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
privileged: false
readOnlyRootFilesystem: {{ .Values.securityContext.readOnlyRootFilesystem }}
runAsNonRoot: true
runAsUser: {{ int .Values.securityContext.runAsUser }}
{{- end -}}

{{- define "shardctl-job.podSecurity" -}}
{{- $uid := int .Values.securityContext.runAsUser -}}
runAsNonRoot: true
runAsUser: {{ $uid }}
runAsGroup: {{ $uid }}
# fsGroup makes the PVC writable by the non-root user.
fsGroup: {{ $uid }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "shardctl-job.volumeMounts" -}}
- name: spec
  mountPath: /etc/shardctl
  readOnly: true
- name: runs
  mountPath: /shardctl/runs
- name: cache
  mountPath: /shardctl/cache
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- range .Values.extraVolumes }}
- {{- toYaml .mount | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "shardctl-job.volumes" -}}
{{- $v := .Values -}}
- name: spec
  configMap:
    name: {{ include "shardctl-job.configmapName" . }}
    defaultMode: 0444
    {{- if $v.codeFiles }}
    {{- /* Keys cannot hold '/': items put the code at its paths, and so must list every file. */}}
    items:
      {{- range $file, $_ := $v.launcherFiles }}
      - key: {{ $file | quote }}
        path: {{ $file | quote }}
      {{- end }}
      - key: job.yaml
        path: job.yaml
      - key: launch.sh
        path: launch.sh
      {{- range $v.codeFiles }}
      - key: {{ .key | quote }}
        path: {{ .path | quote }}
      {{- end }}
    {{- end }}
- name: runs
  {{- if $v.storage.claimName }}
  persistentVolumeClaim:
    claimName: {{ $v.storage.claimName | quote }}
  {{- else }}
  # No PVC (one node only): checkpoints survive container restarts, not pod deletion.
  emptyDir: {}
  {{- end }}
- name: cache
  emptyDir: {}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shmSize | quote }}
{{- range $v.extraVolumes }}
- {{- toYaml .volume | nindent 2 }}
{{- end }}
{{- end -}}

{{- /* Where the pods may run and what they pull with: only what the values give. */ -}}
{{- define "shardctl-job.placement" -}}
{{- $v := .Values -}}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . | quote }}
  {{- end }}
{{- end }}
{{- end -}}
