-- How an apply submission runs (issue 5, "An apply no rule covers still runs in one step").
-- On an Apply Run, 'one_step': no rule covered it, so it ran `apply -auto-approve` with
-- nothing saved in between (it has no planRunId). On a plan Run, 'proposes_apply': an apply
-- submission that a rule covers was planned first with `-out`; once planned, the gate
-- proposes its Apply Run, pinned to the saved plan, and the rules decide on that
-- ('proposed_apply' once it has). NULL: the ordinary paths (a plan, or an Apply Run of a plan someone chose).
ALTER TABLE runs ADD COLUMN apply_mode text CHECK (apply_mode IN ('one_step', 'proposes_apply', 'proposed_apply'));
