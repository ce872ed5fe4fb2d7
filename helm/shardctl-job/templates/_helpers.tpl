{{/*
Every name this chart derives from the job name goes through "shardctl-job.cut".
The job name becomes pod and Service names and label values, which are DNS-1123
labels of at most 63 characters, so a derived name is cut to 63 and a trailing
"-" left by the cut is removed. (Names given as values, such as the PVC and the
service account, are used as they are; values.schema.json checks them.) shardctl's Python renderer (render_k8s.cut_name) does exactly the same,
so `helm template` and `shardctl render` agree on every name.
*/}}
{{- define "shardctl-job.cut" -}}
{{- . | toString | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The job's name (the PyTorchJob, its pods' stem, the instance label). */}}
{{- define "shardctl-job.name" -}}
{{- $name := required "values.name is empty: set the job name, or render the values with `shardctl render SPEC --cluster k8s`" .Values.name -}}
{{- include "shardctl-job.cut" $name -}}
{{- end -}}

{{/* The ConfigMap carrying job.yaml and launch.sh: "<name>-spec". */}}
{{- define "shardctl-job.configmapName" -}}
{{- include "shardctl-job.cut" (printf "%s-spec" (include "shardctl-job.name" .)) -}}
{{- end -}}

{{/* The user's labels (values.labels), then the chart's own, which win; the user's annotations. */}}
{{- define "shardctl-job.metadata" -}}
labels:
  {{- include "shardctl-job.labels" . | nindent 2 }}
{{- with .Values.annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "shardctl-job.labels" -}}
{{- $own := include "shardctl-job.ownLabels" . | fromYaml -}}
{{- toYaml (merge $own (.Values.labels | default dict)) -}}
{{- end -}}

{{- define "shardctl-job.ownLabels" -}}
app.kubernetes.io/component: training
app.kubernetes.io/instance: {{ include "shardctl-job.name" . }}
app.kubernetes.io/name: shardctl
app.kubernetes.io/part-of: shardctl
{{- end -}}

{{/*
Checks the schema cannot express, with the fix in the message.
Included by every template so that any render fails the same way.
*/}}
{{- define "shardctl-job.validate" -}}
{{- $v := .Values -}}
{{- if not $v.jobSpec -}}
{{- fail "values.jobSpec is empty: it is the validated job.yaml the ranks read. Render the values with `shardctl render SPEC --cluster k8s --out DIR` and install with `-f DIR/values.yaml`" -}}
{{- end -}}
{{- if not $v.launchScript -}}
{{- fail "values.launchScript is empty: render the values with `shardctl render SPEC --cluster k8s --out DIR` and install with `-f DIR/values.yaml`" -}}
{{- end -}}
{{- if not $v.image -}}
{{- fail "values.image is empty: the pods need an image with torch and shardctl (build one with shardctl's Containerfile, or render the values from a spec with k8s.image)" -}}
{{- end -}}
{{- if $v.elastic -}}
{{- if gt (int $v.elastic.minReplicas) (int $v.elastic.maxReplicas) -}}
{{- fail (printf "values.elastic.minReplicas (%d) is larger than values.elastic.maxReplicas (%d): set minReplicas <= maxReplicas" (int $v.elastic.minReplicas) (int $v.elastic.maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int $v.nodes) (int $v.elastic.minReplicas)) (gt (int $v.nodes) (int $v.elastic.maxReplicas)) -}}
{{- fail (printf "values.nodes (%d) must lie within values.elastic [minReplicas %d, maxReplicas %d]: change nodes or the elastic range" (int $v.nodes) (int $v.elastic.minReplicas) (int $v.elastic.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- /* Checkpoints in a bucket need no shared volume: each pod uploads its own ranks' files. */ -}}
{{- $checkpoints := dig "checkpoint" "dir" "" (fromYaml $v.jobSpec) | toString | trim | lower -}}
{{- if and (gt (int $v.nodes) 1) (not $v.storage.claimName) (not (hasPrefix "s3:" $checkpoints)) -}}
{{- fail (printf "values.storage.claimName is empty but values.nodes is %d and the job's checkpoint.dir is a path: the pods write one checkpoint together, which needs one volume they all mount; name a ReadWriteMany PersistentVolumeClaim (storage.create: true makes one), or render the values from a spec whose checkpoint.dir is s3://" (int $v.nodes)) -}}
{{- end -}}
{{- if and $v.storage.create (not $v.storage.claimName) -}}
{{- fail "values.storage.create is true but values.storage.claimName is empty: name the PersistentVolumeClaim to create (the run directory and checkpoints live on it)" -}}
{{- end -}}
{{- if and $v.serviceAccount.create (not $v.serviceAccount.name) -}}
{{- fail "values.serviceAccount.create is true but values.serviceAccount.name is empty: name the service account to create" -}}
{{- end -}}
{{- end -}}
