-- The reaper's pass looks for queued Runs nothing has touched for a while
-- (`runs::stuck_queued`). Without an index it read every Run the instance ever had, on
-- every pass of every process that reaps (208 ms a pass at 1,000,000 Runs). Only queued
-- Runs are in this one, so the pass reads what it looks for, and an insert (a Run starts
-- queued) writes one small index more.
CREATE INDEX runs_queued_idle ON runs (updated_at) WHERE status = 'queued';
