-- The rules in force: each scope's (a Workspace's, or one Capsule's) latest version, defined
-- once for everything that reads them (the plan's dry-run check, the gate, the API's
-- one-step decision, the evidence writer). A query naming a Workspace and a scope is pushed
-- into the view (both are its DISTINCT ON columns), so both scopes of a Capsule are one
-- statement: the dry-run check on a plan's path read them in two round trips.
CREATE VIEW rules_in_force AS
SELECT DISTINCT ON (workspace_id, capsule_id) workspace_id, capsule_id, version, rules, created_by
  FROM rule_sets
 ORDER BY workspace_id, capsule_id, version DESC;
