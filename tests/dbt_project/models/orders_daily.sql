{#- One business day's orders appended per run; the pre-hook replaces that day's rows first
    (macros/run_key.sql), so a rerun or retry of a day never duplicates them. -#}
{{
  config(
    materialized="incremental",
    incremental_strategy="append",
    pre_hook="{{ replace_run_key_rows('order_date') }}",
  )
}}

select order_id, customer_id, amount, order_date
from {{ source("shop", "raw_orders") }}
where order_date = '{{ run_key() }}'::date
