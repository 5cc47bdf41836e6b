{{ config(materialized="table") }}

select customer_id, count(*) as orders, sum(amount) as amount
from {{ ref("orders_daily") }}
group by customer_id
