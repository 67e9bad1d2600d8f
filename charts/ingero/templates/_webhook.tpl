{{/*
The profiler-plugin webhook: its Service (the name its certificate is for) and TLS.
*/}}
{{- define "ingero.webhook.name" -}}
{{- printf "%s-webhook" (include "ingero.operator.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ingero.webhook.tlsSecretName" -}}
{{- printf "%s-tls" (include "ingero.webhook.name" .) -}}
{{- end -}}

{{/*
The webhook's CA and serving certificate as YAML with base64 values (caCert, tlsCert,
tlsKey): those of the Secret already in the cluster, so an upgrade keeps them and the
caBundle stays what the running operator serves, else a new CA (genCA) and a
certificate it signs for the Service's DNS names (genSignedCert), both for 10 years.
Include it once per render (templates/webhook.yaml) so the Secret and the caBundle agree.
*/}}
{{- define "ingero.webhook.tls" -}}
{{- $svc := include "ingero.webhook.name" . -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (include "ingero.webhook.tlsSecretName" .) | default dict -}}
{{- $data := get $secret "data" | default dict -}}
{{- if and (get $data "ca.crt") (get $data "tls.crt") (get $data "tls.key") -}}
caCert: {{ get $data "ca.crt" }}
tlsCert: {{ get $data "tls.crt" }}
tlsKey: {{ get $data "tls.key" }}
{{- else -}}
{{- $fqdn := printf "%s.%s.svc" $svc .Release.Namespace -}}
{{- $ca := genCA (printf "%s-ca" $svc) 3650 -}}
{{- $cert := genSignedCert $fqdn nil (list $svc (printf "%s.%s" $svc .Release.Namespace) $fqdn) 3650 $ca -}}
caCert: {{ $ca.Cert | b64enc }}
tlsCert: {{ $cert.Cert | b64enc }}
tlsKey: {{ $cert.Key | b64enc }}
{{- end -}}
{{- end -}}
