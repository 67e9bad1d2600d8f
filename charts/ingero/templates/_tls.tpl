{{/*
Where the agents' certificate comes from:
  off          tls.enabled=false: plain HTTP (unsafe)
  existing     tls.secretName, certManager off: the user's Secret, the chart creates none
  cert-manager tls.certManager.enabled: a cert-manager Certificate writes the Secret
  generated    otherwise: the chart generates a CA and a certificate (templates/tls.yaml)
*/}}
{{- define "ingero.tls.mode" -}}
{{- if not .Values.tls.enabled -}}off
{{- else if .Values.tls.certManager.enabled -}}cert-manager
{{- else if .Values.tls.secretName -}}existing
{{- else -}}generated
{{- end -}}
{{- end -}}

{{/* The Secret with tls.crt, tls.key and the CA: the user's, else <fullname>-agent-tls. */}}
{{- define "ingero.tls.secretName" -}}
{{- default (printf "%s-agent-tls" (include "ingero.fullname" .)) .Values.tls.secretName -}}
{{- end -}}

{{/* Key of the CA certificate in that Secret: tls.caKey for the user's own Secret; the
generated Secret and cert-manager's hold it under ca.crt. */}}
{{- define "ingero.tls.caKey" -}}
{{- if eq (include "ingero.tls.mode" .) "existing" -}}{{ .Values.tls.caKey }}{{- else -}}ca.crt{{- end -}}
{{- end -}}

{{/*
The generated Secret's data (base64 tls.crt, tls.key, ca.crt) as YAML. An upgrade keeps
what is in the cluster (lookup) while it was issued for the same server name; otherwise
(a first install, `helm template`, a changed tls.serverName) a new CA and certificate.
Computed once per render and kept in .Values.tls (the Secret and the pods' checksum
annotations must see the same certificate): genCA is random on every call. The CA's key
is not stored anywhere: nothing in the cluster can sign another certificate with it.
*/}}
{{- define "ingero.tls.generated" -}}
{{- if not (hasKey .Values.tls "_generatedData") -}}
{{- $name := include "ingero.tls.secretName" . -}}
{{- $serverName := include "ingero.tls.serverName" . -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace $name | default dict -}}
{{- $data := get $old "data" | default dict -}}
{{- $oldName := dig "metadata" "annotations" "ingero.io/server-name" "" $old -}}
{{- if and (get $data "tls.crt") (get $data "tls.key") (get $data "ca.crt") (eq $oldName $serverName) -}}
{{- $_ := set .Values.tls "_generatedData" (dict "tls.crt" (get $data "tls.crt") "tls.key" (get $data "tls.key") "ca.crt" (get $data "ca.crt")) -}}
{{- else -}}
{{- $days := int .Values.tls.validityDays -}}
{{- $ca := genCA (printf "%s-agent-ca" (include "ingero.fullname" .)) $days -}}
{{- $cert := genSignedCert $serverName nil (list $serverName) $days $ca -}}
{{- $_ := set .Values.tls "_generatedData" (dict "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) "ca.crt" ($ca.Cert | b64enc)) -}}
{{- end -}}
{{- end -}}
{{- toYaml (get .Values.tls "_generatedData") -}}
{{- end -}}

{{/* Pod annotation: restart agents and operator when the generated certificate changes
(agents load it at start); nothing for certificates the chart does not make. */}}
{{- define "ingero.tls.checksum" -}}
{{- if eq (include "ingero.tls.mode" .) "generated" -}}
checksum/tls: {{ include "ingero.tls.generated" . | sha256sum | trunc 16 }}
{{- end -}}
{{- end -}}
