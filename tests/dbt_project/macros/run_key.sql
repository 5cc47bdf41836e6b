{#-
  The run key (the business day, YYYY-MM-DD) of the task that runs dbt: the cluster policy
  puts it in AIRFLOW_IDEMPOTENCY_RUN_KEY while the task executes (docs/dbt.md). Parsing
  (cosmos's `dbt ls`) has none; running a model without one is refused, so a model is never
  built for "no day".
-#}
{% macro run_key() -%}
  {%- set key = env_var('AIRFLOW_IDEMPOTENCY_RUN_KEY', '') -%}
  {%- if execute and not key -%}
    {{ exceptions.raise_compiler_error(
        "AIRFLOW_IDEMPOTENCY_RUN_KEY is not set: run this model through an Airflow task under "
        ~ "the idempotency contract (docs/dbt.md), or set it to the business day (YYYY-MM-DD)") }}
  {%- endif -%}
  {{- key -}}
{%- endmacro %}

{#-
  A pre-hook for an append incremental model keyed by day: inside the model's transaction
  (dbt runs hooks there by default), wait for any other build of this model and day, then
  delete the day's rows, so that the append that follows replaces them. A rerun or a retry
  after dbt committed (the task died before its completion was recorded) appends the day
  again without duplicating it. On the first build the table does not exist yet: nothing to
  delete.
-#}
{% macro replace_run_key_rows(column) -%}
  {%- if is_incremental() -%}
    select pg_advisory_xact_lock(hashtext('{{ this }}'), hashtext('{{ run_key() }}'));
    delete from {{ this }} where {{ column }} = '{{ run_key() }}'::date
  {%- else -%}
    select 1
  {%- endif -%}
{%- endmacro %}
